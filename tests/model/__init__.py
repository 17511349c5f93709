"""A model checker over the whole daemon: random operation sequences against real
processes, each checked against a small model of what must hold (docs/reliability.md,
"The model checker")."""

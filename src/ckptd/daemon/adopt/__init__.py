"""Adoption of checkpoint directories other frameworks write (Orbax, DCP, ...)."""

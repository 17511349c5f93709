"""Property-based fuzzing of every gRPC RPC against one live daemon (``make fuzz``)."""

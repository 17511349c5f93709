"""The wire API: a thin gRPC servicer, request validation, domain-to-message conversion."""

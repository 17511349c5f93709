"""Framework integrations driven by each framework's own code (``make test-frameworks``)."""

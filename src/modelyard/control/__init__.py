"""The control plane: registry, endpoints and their replicas, and the backends that run them."""

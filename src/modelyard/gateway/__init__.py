"""The data plane: auth, rate limits and quotas, routing, proxying, metering."""

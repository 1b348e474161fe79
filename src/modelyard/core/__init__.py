"""Plain types shared by control and gateway: identity, routing table, domain errors, statuses."""

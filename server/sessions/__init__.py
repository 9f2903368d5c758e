"""The trunk side of each protocol: session handlers for the data plane's endpoint."""

"""HTTP routes, one module per resource. Routes stay short: parse, generate, encode."""

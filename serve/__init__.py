"""omnidit's serving layer: an OpenAI-style HTTP API over one AsyncEngine, and the CLI."""

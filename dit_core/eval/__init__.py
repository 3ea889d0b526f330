"""Quality measurement on the embedded default model (see ``digits``)."""

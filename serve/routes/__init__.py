"""HTTP routes: image generation (and the files it serves), models, health, metrics."""

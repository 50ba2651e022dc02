"""launch package."""

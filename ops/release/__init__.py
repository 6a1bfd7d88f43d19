"""Release: deploying a build to a running server, watching it, rolling back, and drift detection."""

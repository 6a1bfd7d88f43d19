"""Tuning and its judge: the search against static-best per traffic slice, capacity A/B on the judge, the
held-out re-measurement over HTTP, the cost model against measurement, experiments per minute."""

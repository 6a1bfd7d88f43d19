"""The judge: capacity at the SLO as a statistical quantity, the lockstep paired measurements, and the one
decision rule every choice, deployment and rollback goes through."""

"""Training engines behind one Protocol; heavy frameworks are imported inside their adapters only."""

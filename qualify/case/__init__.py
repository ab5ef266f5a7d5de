"""A case, apart from any stage: its spec (what a case's ranks are told), the engine context made from it (the one
constructor the candidate worker, diagnose and rounds use), the launch of its ranks and their start-up, and where
they run. The candidate stage, diagnose, rounds and the engines import it; it imports none of them."""

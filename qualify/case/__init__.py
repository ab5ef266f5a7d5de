"""A case, apart from any stage: its spec (what a case's ranks are told), the engine context made from it (the one
constructor the candidate worker, diagnose and rounds use), the launch of its ranks and their start-up, where they
run, and its meta.json (meta.CaseMeta: written by the candidate worker, read by the judge, the report and the rounds). The candidate stage, diagnose, rounds and the engines import it; it imports none of them."""

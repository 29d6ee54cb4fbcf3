"""The checkers of notebook 09's exercises: ring attention (:mod:`.ring`) and the
mixture-of-experts dispatch and combine (:mod:`.experts`)."""

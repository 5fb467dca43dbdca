"""Model families that live outside meshpilot, as a user's own package would.

``gpt2.py`` is a GPT-2-style decoder named in a config as ``model.family:
tests.families.gpt2:Gpt2Family``; the integration tests train it on every parallel layout to
show that the family protocol carries an architecture other than the shipped one.
"""

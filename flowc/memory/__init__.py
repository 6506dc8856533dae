"""Static memory planning (plan.py) and its independent checker (check.py)."""

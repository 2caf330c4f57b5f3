"""What every kernel shares: launching (launch.py, limits.py), per-call plans (plan.py), configs and
their tuning (tuning.py, config_store.py, shipped_configs.json), the background compile of the other
token-count classes (other_token_class.py) and the ahead-of-time compile of every kernel (aot.py)."""

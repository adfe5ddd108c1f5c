"""tinker_exp's Hydra launchers (Hydra finds plugins only inside the `hydra_plugins` namespace)."""

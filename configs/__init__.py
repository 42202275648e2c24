"""minite.configs: the shipped YAML configs (arms/, models/, rl/) and their JSON schemas (schemas/), installed
with the package; ``minite.yamlconfig`` loads them."""

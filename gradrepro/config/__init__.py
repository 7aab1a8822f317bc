"""The config: schemas (``schema``), resolvers (``resolvers``), where the YAML lives and how
it is composed (``compose``), and the checks a composed config must pass (``validate``)."""

"""Model families: each package assembles one family's engine from its bundle."""

"""aiodist's pytest plugin. Inert unless its fixtures or markers are used."""

"""contracts: the typed, versioned documents that travel between rooms and out of the
process (snapshot, layer profile, request statistics, window advice, profile.json). Each
has one ``to_json``/``from_json`` pair and a JSON Schema in ``docs/schema/``."""

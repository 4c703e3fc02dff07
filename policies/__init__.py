"""Package data: the committed length policies, their tuned rules and engine tables, by machine key and draft
(`<key>/<draft>/policy.json`). Found through `specpilot.decoding.paths.find_artifact`."""

"""Package data: the committed draft heads (`<name>/draft_head.json` + weights). Found through
`specpilot.decoding.paths.find_artifact`."""

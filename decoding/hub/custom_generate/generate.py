"""specpilot's speculative loop as a Hub-style `custom_generate` folder:
`model.generate(**inputs, custom_generate="<this folder's parent>", trust_remote_code=True, draft="ngram",
policy="learned")`. Needs the `specpilot` package installed (it runs `specpilot.decoding.hf.specpilot_generate`)."""


def generate(model, **kwargs):
    from specpilot.decoding.hf import generate_from_folder

    return generate_from_folder(model, **kwargs)

"""Starting from pretrained weights: importers per source family (ProLIP, open_clip / OpenAI
CLIP, SigLIP from big_vision or timm), Hugging Face hub resolution, and the partial load that
turns an imported model into the initialisation of a ProLIP (`warm_start`)."""

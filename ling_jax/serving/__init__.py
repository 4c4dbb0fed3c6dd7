"""`ling-serve`: an OpenAI-compatible HTTP server with continuous batching over fixed slots (a wing: it imports
the model core and the generation wing). `engine` runs the jitted programs over the slot batch, `scheduler`
admits requests into slots at step boundaries, `api` serves the HTTP routes, `cli` is the command."""

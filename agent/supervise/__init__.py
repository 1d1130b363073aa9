"""The training supervisor: start torchrun (warm worker pool included), stop its whole process
tree, and run the node's side of a notice (checkpoint, upload, leave). ``ElasticHooks`` plugs it
into the agent through the ``agent.hooks.NodeHooks`` interface."""

"""A job as a user writes it (a job file), and its code on its way to the nodes."""

"""A distributed run: the records of Locust workers sent to the master over Locust's messages."""

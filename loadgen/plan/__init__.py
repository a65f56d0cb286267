"""What a load process sends and when: its job from Locust's options, and arrival pacing."""

"""The ground floor: errors for users, the record schema, the results store.

Imports nothing of kvbench."""

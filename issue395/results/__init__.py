"""The results wing: an arm's row, a run's result, the saved schema and its migration, shards
merged, rows saved as they finish, the stack every output carries, the corrected column.
"""

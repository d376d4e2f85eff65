"""What each part of the job page (and the job list) shows, one module per part, and a cheap signature per
part for cursor polling (``signatures.py``).

A view asks a part for its context; the part reads the stored facts, takes its numbers from
``jobs.readouts`` and its figures from ``dashboard.plots``.
"""

"""Every plotly figure the dashboard draws, built and downsampled on the server (the page only renders them).

Every builder returns plain JSON-able dicts. Times on the wire are unix milliseconds (plotly reads
them as UTC on a date axis); durations are seconds in labels and milliseconds as bar lengths.
Downsampling keeps each figure to a bounded number of marks whatever the job's length
(``downsample.py``: ``MAX_POINTS`` checkpoint points; the recovery timeline bins its bars).
"""

"""Building blocks shared by every model family: linear, norm, rotary, attention, embedding."""

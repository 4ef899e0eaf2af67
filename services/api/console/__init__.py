"""The browser console at /: static pages (static/), the live stats stream, the request inspector."""

"""The report as a page: the template context, its tables and plots, HTML and Markdown."""

"""The align job: raw text or conversations -> aligned Arrow shards (``make align``).

`job` assembles the pipeline; `readers` / `chat_read` read the inputs; `align_dofns` and
`chat_dofns` tokenize and align (calling `tokenbridge.alignment` and `tokenbridge.chat`);
`chat_records` and `job_stats` build rows and statistics; `write_dofns` writes them.
"""

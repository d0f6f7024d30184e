"""Conversations (chat data): rows -> each model's own chat template -> aligned token arrays.

Read in this order: `rows` (formats, parsing, dead-letter reasons), `templates` (where a
template comes from, the shipped ones, the rendering call), `render` (content spans in a
rendering; `edges` for contents a template writes without their edge whitespace), `encode`
(tokenizing a rendering), `markers` (turn markers and content tokens per side), `train_flags`
(train flags), `pairs` (chunks of a student-teacher pair), `align` (the batch entry point,
`align_conversations`).
`example` writes the shipped example conversations.
"""

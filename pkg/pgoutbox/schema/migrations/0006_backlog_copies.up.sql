-- Where a new group starts: the cursor of a group's backlog copy (NULL when
-- it has none to do; see StartFromBacklog). Publishers never read them.
ALTER TABLE {{table "_bindings"}} ADD COLUMN IF NOT EXISTS backlog_next bigint;
ALTER TABLE {{table "_bindings"}} ADD COLUMN IF NOT EXISTS backlog_bound bigint;
ALTER TABLE {{table "_bindings"}} ADD COLUMN IF NOT EXISTS backlog_end bigint;

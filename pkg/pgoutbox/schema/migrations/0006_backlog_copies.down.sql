-- A backlog copy under way stops; its group keeps what was copied.
ALTER TABLE {{table "_bindings"}} DROP COLUMN IF EXISTS backlog_end;
ALTER TABLE {{table "_bindings"}} DROP COLUMN IF EXISTS backlog_bound;
ALTER TABLE {{table "_bindings"}} DROP COLUMN IF EXISTS backlog_next;

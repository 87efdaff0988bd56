-- Version 6 has no arrivals: their messages would be lost, so the step
-- refuses while the table holds any. Unset Arrivals in every publisher
-- and let the subscribers take what is left first.
DO $pgoutbox$ BEGIN
    IF to_regclass('{{table "_arrivals"}}') IS NOT NULL THEN
        -- Locked first: an arrival committed after the check would be lost.
        LOCK TABLE {{table "_arrivals"}} IN ACCESS EXCLUSIVE MODE;
        IF EXISTS (SELECT 1 FROM {{table "_arrivals"}}) THEN
            RAISE EXCEPTION '% holds messages that version 6 has no place for; unset Arrivals in every publisher, let the subscribers (with Arrivals set) take them, then migrate down', '{{table "_arrivals"}}';
        END IF;
    END IF;
END $pgoutbox$;
DROP TABLE IF EXISTS {{table "_arrivals"}};
ALTER TABLE {{table "_bindings"}} DROP COLUMN IF EXISTS arrivals_from;

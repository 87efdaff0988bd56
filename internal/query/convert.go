package query

import (
	"fmt"
	"slices"
	"strings"
)

// ConversionStatements turn a single-table outbox into a rotating one
// (see schema.ConvertToRotating). The single table becomes the long
// partition: its rows stay where they are, and new rows go into the ring.
// Everything that takes long (building two indexes, checking that every
// row belongs to the long partition) runs first, without blocking
// publishers or consumers; the swap itself is catalog changes under one
// short ACCESS EXCLUSIVE lock.
type ConversionStatements struct {
	// ForeignColumns lists the single table's columns pgoutbox does not
	// know: the partitioned table has none of them, so attaching refuses.
	ForeignColumns string
	// Prepare gives the single table its generation column, with a
	// constant default (a catalog change, not a rewrite), and CHECK
	// (generation = 3) NOT VALID, in one ALTER TABLE; ValidateCheck checks
	// that against every row without blocking writes: with it, attaching
	// the table does not scan it under the lock. Prepare does nothing to a
	// table that is partitioned already (another conversion finished).
	Prepare, ValidateCheck string
	// Building: whether an index build runs on the outbox now (a
	// conversion running beside this one), whose index looks invalid
	// until it is done.
	Building string
	// IndexState: $1 an index name in the outbox's schema; its validity
	// (false after a failed concurrent build), no row when it is missing.
	IndexState string
	// DropIndex: DropIndex[i] drops Prepared[i] (left invalid by a failed
	// build).
	DropIndex []string
	// Prepared builds, concurrently, the long partition's indexes that the
	// single table lacks: the primary key on (id, generation) and the
	// dedup index with the generation, which a partitioned table's unique
	// indexes must hold. PreparedNames are their names.
	Prepared      []string
	PreparedNames []string
	// Lock takes the single table's ACCESS EXCLUSIVE lock for the swap.
	Lock string
	// NextID: the id the partitioned table's identity starts from.
	NextID string
	// Release turns the locked single table into the long partition to
	// be: primary key and dedup index with the generation, no identity,
	// indexes and table renamed to the long partition's names.
	Release string
	// RestartID ($1 NextID's value, inlined: DDL takes no parameters),
	// Unmatched and Attach run after DDL made the partitioned table.
	RestartID func(next int64) string
	// Unmatched lists the partitioned table's indexes that the long
	// partition to be has no index of the same definition for: ATTACH
	// would build those under the lock, for as long as the table takes.
	Unmatched string
	Attach    string
	// DropCheck removes AddCheck's constraint once attached (the
	// partition's bound says the same).
	DropCheck string
	// Handover gives the partitioned table, its new partitions and its
	// sequence the single table's owner (whoever converts it) and grants
	// (table and column ones), and what the same roles need of a rotating
	// outbox: who could insert may read the generation sequence (every
	// insert does) and write the generation, who could delete (consumers)
	// may also advance it and read, lock and truncate the ring's
	// partitions (the rotation step; the long partition is never
	// truncated).
	Handover string
}

// Conversion returns the statements that convert n's single table; n is
// the rotating outbox's names (Rotated).
func Conversion(n Names) ConversionStatements {
	long := n.Generations[LongGeneration]
	qlong := n.QGeneration(LongGeneration)
	ln, _ := NewNames(n.Schema, long, "") // the long partition's index names
	pkey := derive(long, "_pkey")
	check := derive(long, "_generation_check")
	known := make([]string, 0, len(OutboxColumns)+1)
	for _, c := range append(slices.Clip(OutboxColumns), GenerationColumn) {
		known = append(known, "'"+c.Name+"'")
	}
	s := ConversionStatements{
		ForeignColumns: fmt.Sprintf(`SELECT attname::text FROM pg_attribute WHERE attrelid = '%s'::regclass AND attnum > 0 AND NOT attisdropped
   AND attname NOT IN (%s) ORDER BY attnum`, n.QTable, strings.Join(known, ", ")),
		Prepare: fmt.Sprintf(`DO $pgoutbox$ BEGIN
    IF (SELECT relkind FROM pg_catalog.pg_class WHERE oid = '%[1]s'::regclass) = 'r' AND NOT EXISTS (
           SELECT FROM pg_catalog.pg_attribute WHERE attrelid = '%[1]s'::regclass AND attname = 'generation' AND NOT attisdropped) THEN
        ALTER TABLE %[1]s ADD COLUMN generation smallint NOT NULL DEFAULT %[2]d,
            ADD CONSTRAINT %[3]s CHECK (generation = %[2]d) NOT VALID;
    END IF;
END $pgoutbox$`, n.QTable, LongGeneration, Quote(check)),
		Building: fmt.Sprintf(`SELECT EXISTS (SELECT FROM pg_stat_progress_create_index WHERE relid = '%s'::regclass)`, n.QTable),
		IndexState: fmt.Sprintf(`SELECT i.indisvalid::text FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
  JOIN pg_namespace ns ON ns.oid = c.relnamespace WHERE ns.nspname = '%s' AND c.relname = $1`, n.Schema),
		Prepared: []string{
			fmt.Sprintf(`CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS %s ON %s (id, generation)`, Quote(pkey), n.QTable),
			fmt.Sprintf(`CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS %s ON %s %s`, Quote(ln.DedupIdx), n.QTable, n.dedupConflict()),
		},
		PreparedNames: []string{pkey, ln.DedupIdx},
		ValidateCheck: fmt.Sprintf(`ALTER TABLE %s VALIDATE CONSTRAINT %s`, n.QTable, Quote(check)),
		Lock:          fmt.Sprintf(`LOCK TABLE %s IN ACCESS EXCLUSIVE MODE`, n.QTable),
		NextID:        nextID(n),
		Release: fmt.Sprintf(`DO $pgoutbox$ DECLARE pk name; BEGIN
    SELECT conname INTO pk FROM pg_catalog.pg_constraint WHERE conrelid = '%[1]s'::regclass AND contype = 'p';
    IF pk IS NOT NULL THEN
        EXECUTE format('ALTER TABLE %[1]s DROP CONSTRAINT %%I', pk);
    END IF;
    ALTER TABLE %[1]s ADD CONSTRAINT %[2]s PRIMARY KEY USING INDEX %[2]s;
    ALTER TABLE %[1]s ALTER COLUMN id DROP IDENTITY IF EXISTS;
    DROP INDEX IF EXISTS %[3]s.%[4]s;
%[5]s    ALTER TABLE %[1]s RENAME TO %[6]s;
END $pgoutbox$`, n.QTable, Quote(pkey), n.QSchema, Quote(n.DedupIdx), renames(n, ln), Quote(long)),
		RestartID: func(next int64) string {
			return fmt.Sprintf(`ALTER TABLE %s ALTER COLUMN id RESTART WITH %d`, n.QTable, next)
		},
		Unmatched: fmt.Sprintf(`SELECT pc.relname::text FROM pg_catalog.pg_index p JOIN pg_catalog.pg_class pc ON pc.oid = p.indexrelid
 WHERE p.indrelid = '%[1]s'::regclass AND NOT EXISTS (
       SELECT FROM pg_catalog.pg_index l
        WHERE l.indrelid = '%[2]s'::regclass AND l.indisvalid AND l.indisunique = p.indisunique
          AND %[3]s = %[4]s)
 ORDER BY 1`, n.QTable, qlong, indexShape("l"), indexShape("p")),
		Attach:    fmt.Sprintf(`ALTER TABLE %s ATTACH PARTITION %s FOR VALUES IN (%d)`, n.QTable, qlong, LongGeneration),
		DropCheck: fmt.Sprintf(`ALTER TABLE %s DROP CONSTRAINT IF EXISTS %s`, qlong, Quote(check)),
	}
	for _, name := range s.PreparedNames {
		s.DropIndex = append(s.DropIndex, fmt.Sprintf(`DROP INDEX CONCURRENTLY IF EXISTS %s.%s`, n.QSchema, Quote(name)))
	}
	var ring, ringLiterals []string
	for g := range RingSize {
		ring = append(ring, n.QGeneration(g))
		ringLiterals = append(ringLiterals, "'"+n.QGeneration(g)+"'")
	}
	s.Handover = fmt.Sprintf(`DO $pgoutbox$ DECLARE r record; part text; owner text; BEGIN
    SELECT relowner::regrole::text INTO owner FROM pg_catalog.pg_class WHERE oid = '%[1]s'::regclass;
    EXECUTE format('ALTER TABLE %[2]s OWNER TO %%s', owner); -- its sequences follow
    FOREACH part IN ARRAY ARRAY[%[5]s] LOOP
        EXECUTE format('ALTER TABLE %%s OWNER TO %%s', part, owner);
    END LOOP;
    FOR r IN `+tableGrants("'%[1]s'")+` LOOP
        EXECUTE format('GRANT %%s ON %[2]s TO %%s%%s', r.priv, r.who, r.opt);
        -- SELECT, not USAGE: reading the sequence is enough, and USAGE
        -- would let a publisher turn the ring with nextval.
        IF r.priv = 'INSERT' THEN
            EXECUTE format('GRANT SELECT ON SEQUENCE %[3]s TO %%s', r.who);
        ELSIF r.priv = 'DELETE' THEN
            EXECUTE format('GRANT SELECT, UPDATE ON SEQUENCE %[3]s TO %%s', r.who);
            EXECUTE format('GRANT SELECT, UPDATE, TRUNCATE ON %[4]s TO %%s', r.who);
        END IF;
    END LOOP;
    FOR r IN `+columnGrants("'%[1]s'")+` LOOP
        EXECUTE format('GRANT %%s (%%I) ON %[2]s TO %%s%%s', r.priv, r.col, r.who, r.opt);
        IF r.priv = 'SELECT' AND r.col = 'dedup_key' THEN
            -- a keyed publish's conflict target holds the generation
            EXECUTE format('GRANT SELECT (generation) ON %[2]s TO %%s', r.who);
        ELSIF r.priv = 'INSERT' AND r.col = 'topic' THEN
            EXECUTE format('GRANT INSERT (generation) ON %[2]s TO %%s', r.who);
            EXECUTE format('GRANT SELECT ON SEQUENCE %[3]s TO %%s', r.who);
        END IF;
    END LOOP;
END $pgoutbox$`, qlong, n.QTable, n.QGenSeq, strings.Join(ring, ", "), strings.Join(ringLiterals, ", "))
	return s
}

// tableGrants selects the grants on table rel (a quoted literal) to roles
// other than its owner, as priv, who (the grantee, quoted, or PUBLIC) and
// opt (" WITH GRANT OPTION" or ""), for a loop that grants them again.
func tableGrants(rel string) string {
	return `SELECT a.privilege_type AS priv,
                    CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END AS who,
                    CASE WHEN a.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END AS opt
               FROM pg_catalog.pg_class c, aclexplode(c.relacl) a
              WHERE c.oid = ` + rel + `::regclass AND a.grantee <> c.relowner`
}

// columnGrants is tableGrants for rel's column grants, with col the
// column's name.
func columnGrants(rel string) string {
	return `SELECT att.attname AS col, a.privilege_type AS priv,
                    CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END AS who,
                    CASE WHEN a.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END AS opt
               FROM pg_catalog.pg_attribute att, aclexplode(att.attacl) a
              WHERE att.attrelid = ` + rel + `::regclass AND att.attacl IS NOT NULL AND NOT att.attisdropped`
}

// nextID selects the id an identity of n's outbox, made anew, must start
// from: the next value of the current one's sequence (taken, so even ids
// handed out and not yet committed are behind it; a read would miss a
// sequence restarted and not used since), and past every id in the outbox
// and its dead letters, which keep their ids.
func nextID(n Names) string {
	dlq := ""
	if n.QDLQ != "" {
		dlq = fmt.Sprintf(`, coalesce((SELECT max(id) FROM %s), 0) + 1`, n.QDLQ)
	}
	return fmt.Sprintf(`SELECT greatest(nextval(pg_get_serial_sequence('%[1]s', 'id')::regclass),
                coalesce((SELECT max(id) FROM %[2]s), 0) + 1%[3]s)`, strings.ReplaceAll(n.QTable, "'", "''"), n.QTable, dlq)
}

// renames are Release's index renames: the single table's indexes take
// the long partition's names, leaving the outbox's names to the
// partitioned table's indexes.
func renames(n, ln Names) string {
	var b strings.Builder
	for _, p := range [][2]string{{n.ReadyIdx, ln.ReadyIdx}, {n.LeaseIdx, ln.LeaseIdx}, {n.OrderIdx, ln.OrderIdx}, {n.OrderLeaseIdx, ln.OrderLeaseIdx}} {
		fmt.Fprintf(&b, "    ALTER INDEX %s.%s RENAME TO %s;\n", n.QSchema, Quote(p[0]), Quote(p[1]))
	}
	return b.String()
}

// indexShape is what ATTACH PARTITION compares of index p.indexrelid when
// it looks for a partition's index to adopt: its definition after USING
// (method, columns, operator classes, predicate), without the storage
// parameters, which ATTACH does not compare (an index a user gave a
// fillfactor is adopted as it is).
func indexShape(p string) string {
	return fmt.Sprintf(`regexp_replace(regexp_replace(pg_get_indexdef(%s.indexrelid), '^.* USING ', ''), ' WITH \([^)]*\)', '')`, p)
}

// SingleConversionStatements turn a rotating outbox back into a single
// table (see schema.ConvertToSingle). The long partition becomes the
// table: the ring's rows are moved into it, in batches that skip what a
// claim holds, and what is left under the partitioned table's lock; the
// two indexes a single table has and the long partition lacks are built
// concurrently first. The swap is then catalog changes under one short
// ACCESS EXCLUSIVE lock, plus the move of the ring's last rows.
type SingleConversionStatements struct {
	// StopRing makes the generation column's default the long
	// partition's, so plain inserts stop going into the ring (keyed,
	// scheduled and ordered inserts of processes running with the
	// rotating setting name their generation and still may, until the
	// swap moves them).
	StopRing string
	// MoveOut[g] moves up to MoveBatch rows nothing holds from ring
	// partition g into the long partition, returning how many.
	MoveOut []string
	// MoveAll moves every row left in the ring, under the lock.
	MoveAll string
	// Building, IndexState, Prepared, PreparedNames and DropIndex are
	// ConversionStatements' for the long partition's two new indexes: a
	// unique index on id (the primary key to be) and the single table's
	// dedup index, without the generation.
	Building      string
	IndexState    string
	Prepared      []string
	PreparedNames []string
	DropIndex     []string
	// GenerationIndexes lists the indexes, other than the primary key
	// and the dedup index, that hold the generation column and would go
	// with it: indexes of yours that a conversion would drop.
	GenerationIndexes string
	// RotationLock ($1 the outbox's quoted name) waits for the
	// rotator's lock, so that no rotation step
	// (which reads the generation sequence, then writes the outbox) runs
	// across the swap: the swap drops that sequence, and a step holding
	// it while waiting for the outbox would deadlock with it.
	RotationLock string
	// Lock takes the partitioned table's ACCESS EXCLUSIVE lock.
	Lock string
	// NextID: the id the single table's identity starts from.
	NextID string
	// Swap ($1 NextID's value, inlined) gives the long partition the
	// partitioned table's grants, detaches it, drops the partitioned table
	// with the ring and the generation sequence, and makes the long
	// partition the single table: its name, its indexes' names (those of
	// the partitioned table's indexes they belonged to, yours included),
	// the primary key on id, the dedup index without the generation, no
	// generation column, and the identity.
	Swap func(next int64) string
}

// MoveBatch is how many rows a SingleConversionStatements.MoveOut moves
// at most.
const MoveBatch = 10000

// SingleConversion returns the statements that turn n's rotating outbox
// back into a single table; n is the rotating outbox's names (Rotated),
// single the single table's.
func SingleConversion(n, single Names) SingleConversionStatements {
	long := n.Generations[LongGeneration]
	qlong := n.QGeneration(LongGeneration)
	idKey := derive(long, "_id_key")
	dedupKey := derive(long, "_dedup_key")
	s := SingleConversionStatements{
		StopRing: fmt.Sprintf(`DO $pgoutbox$ BEGIN
    IF (SELECT pg_get_expr(d.adbin, d.adrelid) FROM pg_catalog.pg_attrdef d JOIN pg_catalog.pg_attribute a
           ON a.attrelid = d.adrelid AND a.attnum = d.adnum
         WHERE d.adrelid = '%[1]s'::regclass AND a.attname = 'generation') IS DISTINCT FROM '%[2]d' THEN
        ALTER TABLE %[1]s ALTER COLUMN generation SET DEFAULT %[2]d;
    END IF;
END $pgoutbox$`, n.QTable, LongGeneration),
		MoveAll:  fmt.Sprintf(`UPDATE %s SET generation = %d WHERE generation < %d`, n.QTable, LongGeneration, LongGeneration),
		Building: fmt.Sprintf(`SELECT EXISTS (SELECT FROM pg_stat_progress_create_index WHERE relid = '%s'::regclass)`, qlong),
		IndexState: fmt.Sprintf(`SELECT i.indisvalid::text FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
  JOIN pg_namespace ns ON ns.oid = c.relnamespace WHERE ns.nspname = '%s' AND c.relname = $1`, n.Schema),
		Prepared: []string{
			fmt.Sprintf(`CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS %s ON %s (id)`, Quote(idKey), qlong),
			fmt.Sprintf(`CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS %s ON %s %s`, Quote(dedupKey), qlong, single.dedupConflict()),
		},
		PreparedNames: []string{idKey, dedupKey},
		Lock:          fmt.Sprintf(`LOCK TABLE %s IN ACCESS EXCLUSIVE MODE`, n.QTable),
		NextID:        nextID(n),
		RotationLock:  RotationWait,
		GenerationIndexes: fmt.Sprintf(`SELECT DISTINCT c.relname::text FROM pg_catalog.pg_depend d
  JOIN pg_catalog.pg_class c ON c.oid = d.objid
  JOIN pg_catalog.pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid
 WHERE d.classid = 'pg_catalog.pg_class'::regclass AND c.relkind IN ('i', 'I')
   AND d.refobjid IN ('%[1]s'::regclass, '%[2]s'::regclass) AND a.attname = 'generation'
   AND c.oid NOT IN (SELECT conindid FROM pg_catalog.pg_constraint WHERE conrelid = '%[1]s'::regclass AND contype = 'p')
   AND c.oid NOT IN (SELECT i.inhrelid FROM pg_catalog.pg_inherits i
                      JOIN pg_catalog.pg_constraint p ON p.conindid = i.inhparent AND p.conrelid = '%[1]s'::regclass AND p.contype = 'p')
   AND c.relname <> '%[3]s'
   AND c.oid NOT IN (SELECT i.inhrelid FROM pg_catalog.pg_inherits i JOIN pg_catalog.pg_class pc ON pc.oid = i.inhparent
                      WHERE pc.relname = '%[3]s' AND pc.relnamespace = '%[4]s'::regnamespace)
 ORDER BY 1`, n.QTable, qlong, strings.ReplaceAll(n.DedupIdx, "'", "''"), n.QSchema),
	}
	for g := range RingSize {
		s.MoveOut = append(s.MoveOut, fmt.Sprintf(`WITH moved AS (
    UPDATE %[1]s o SET generation = %[3]d
     WHERE o.generation = %[4]d AND o.id = ANY (ARRAY(SELECT id FROM %[2]s LIMIT %[5]d FOR UPDATE SKIP LOCKED))
    RETURNING 1
)
SELECT count(*) FROM moved`, n.QTable, n.QGeneration(g), LongGeneration, g, MoveBatch))
	}
	for _, name := range s.PreparedNames {
		s.DropIndex = append(s.DropIndex, fmt.Sprintf(`DROP INDEX CONCURRENTLY IF EXISTS %s.%s`, n.QSchema, Quote(name)))
	}
	s.Swap = func(next int64) string {
		return fmt.Sprintf(`DO $pgoutbox$ DECLARE r record; parent_pk name; parent_pk_index oid; renames text[] := '{}'; i int; BEGIN
    -- The partitioned table's primary key was named as Create names the
    -- single table's: the single table takes its name.
    SELECT conname, conindid INTO parent_pk, parent_pk_index FROM pg_catalog.pg_constraint
     WHERE conrelid = '%[1]s'::regclass AND contype = 'p';
    -- The long partition may still hold grants it had as the single
    -- table before a conversion to rotating: only the partitioned
    -- table's count.
    FOR r IN `+columnGrants("'%[2]s'")+` LOOP
        EXECUTE format('REVOKE ALL (%%I) ON %[2]s FROM %%s CASCADE', r.col, r.who);
    END LOOP;
    FOR r IN SELECT DISTINCT who FROM (`+tableGrants("'%[2]s'")+`) g LOOP
        EXECUTE format('REVOKE ALL ON %[2]s FROM %%s CASCADE', r.who);
    END LOOP;
    FOR r IN `+tableGrants("'%[1]s'")+` LOOP
        EXECUTE format('GRANT %%s ON %[2]s TO %%s%%s', r.priv, r.who, r.opt);
    END LOOP;
    FOR r IN `+columnGrants("'%[1]s'")+` AND att.attname <> 'generation' LOOP
        EXECUTE format('GRANT %%s (%%I) ON %[2]s TO %%s%%s', r.priv, r.col, r.who, r.opt);
    END LOOP;
    -- The long partition's indexes take the names of the partitioned
    -- table's indexes they belong to, but for the primary key and the
    -- dedup index, which the new ones replace.
    FOR r IN SELECT child.relname AS child, parent.relname AS parent
               FROM pg_catalog.pg_index x
               JOIN pg_catalog.pg_class child ON child.oid = x.indexrelid
               JOIN pg_catalog.pg_inherits h ON h.inhrelid = x.indexrelid
               JOIN pg_catalog.pg_class parent ON parent.oid = h.inhparent
              WHERE x.indrelid = '%[2]s'::regclass AND h.inhparent <> parent_pk_index AND parent.relname <> '%[5]s' LOOP
        renames := renames || ARRAY[r.child::text, r.parent::text];
    END LOOP;
    ALTER TABLE %[1]s DETACH PARTITION %[2]s;
    -- With the column go the primary key and the dedup index that hold
    -- it, and its default, which may read the sequence dropped next.
    ALTER TABLE %[2]s DROP COLUMN generation;
    DROP TABLE %[1]s;
    ALTER TABLE %[2]s RENAME TO %[4]s;
    FOR i IN 1 .. coalesce(array_length(renames, 1), 0) / 2 LOOP
        EXECUTE format('ALTER INDEX %[3]s.%%I RENAME TO %%I', renames[2 * i - 1], renames[2 * i]);
    END LOOP;
    EXECUTE format('ALTER TABLE %[1]s ADD CONSTRAINT %%I PRIMARY KEY USING INDEX %[7]s', parent_pk);
    ALTER INDEX %[3]s.%[8]s RENAME TO %[6]s;
    ALTER TABLE %[1]s ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (START WITH %[9]d);
END $pgoutbox$`, n.QTable, qlong, n.QSchema, Quote(n.Table), strings.ReplaceAll(n.DedupIdx, "'", "''"), Quote(n.DedupIdx),
			Quote(idKey), Quote(dedupKey), next)
	}
	return s
}

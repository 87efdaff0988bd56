package query

import "fmt"

// LivenessClass is the first key of every liveness lock
// (pg_advisory_lock(LivenessClass, key)): "pgob" in ASCII, positive, so
// pg_locks shows it unchanged as classid.
const LivenessClass = 0x70676f62

// Liveness statements. A Subscriber's LISTEN connection holds a session
// advisory lock (LivenessClass, key) while it is up; the server drops it the
// moment that connection ends, which is when its process dies. The key is a
// random positive int4, stored with every row the subscriber leases
// (lease_holder).
var (
	TryLiveness = fmt.Sprintf(`SELECT pg_try_advisory_lock(%d, $1::int)`, LivenessClass)
	// LiveHolders lists the keys whose locks are held, in this database.
	LiveHolders = fmt.Sprintf(`SELECT objid::bigint FROM pg_catalog.pg_locks
                    WHERE locktype = 'advisory' AND classid = %d AND objsubid = 2 AND granted
                      AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())`, LivenessClass)
	// LiveHoldersMine is LiveHolders with, per key, whether this session
	// holds it: behind a pooler (PgBouncer) the lock may sit on a server
	// connection that is not, or no longer, the one this session uses.
	LiveHoldersMine = fmt.Sprintf(`SELECT objid::bigint, pid = pg_backend_pid() FROM pg_catalog.pg_locks
                    WHERE locktype = 'advisory' AND classid = %d AND objsubid = 2 AND granted
                      AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())`, LivenessClass)
)

package query

import "fmt"

// GroupStatements bind and unbind consumer groups, purge an unbound
// group's rows, and cancel scheduled rows by key.
type GroupStatements struct {
	Bind          string
	Unbind        string
	Rename        string
	RenameUnpause string
	RenamePause   string
	RenameDLQ     string // "" without a dead-letter table
	Purge         string
	Cancel        string
}

func buildGroups(n Names) GroupStatements {
	t := n.QTable
	return GroupStatements{
		// Bind binds consumer group $2 to topic $1: from then on every
		// message published to the topic gets a row for the group.
		Bind: fmt.Sprintf(`INSERT INTO %s (topic, consumer_group) VALUES ($1, $2) ON CONFLICT DO NOTHING`, n.QBindings),
		// Unbind removes the binding; Purge deletes the group's rows of the
		// topic that nobody holds: unleased, or leased until a time already
		// past (their holder is gone, and with the group unbound nobody may
		// come to claim them). A delivery under way completes.
		Unbind: fmt.Sprintf(`DELETE FROM %s WHERE topic = $1 AND consumer_group = $2`, n.QBindings),
		// Rename gives group $2's binding of topic $1 the name $3, with
		// what it holds (where its arrivals start, its backlog copy's
		// cursor); then, in the same transaction, the new name's pause
		// state becomes the old one's: RenameUnpause (topic $1, new name
		// $2) and RenamePause (as Rename).
		Rename:        fmt.Sprintf(`UPDATE %s SET consumer_group = $3 WHERE topic = $1 AND consumer_group = $2`, n.QBindings),
		RenameUnpause: fmt.Sprintf(`DELETE FROM %s WHERE topic = $1 AND consumer_group = $2`, n.QPaused()),
		RenamePause:   fmt.Sprintf(`UPDATE %s SET consumer_group = $3 WHERE topic = $1 AND consumer_group = $2`, n.QPaused()),
		// RenameDLQ (as Rename): the group's dead letters are the new
		// name's, so a requeue gives them back to a bound group.
		RenameDLQ: renameDLQ(n),
		Purge: fmt.Sprintf(`DELETE FROM %s WHERE topic = $1 AND consumer_group = $2
   AND (lease_token IS NULL OR leased_until < now())`, t),

		// Cancel deletes a scheduled row by key, in every consumer group,
		// but only while nobody holds it: a delivery already running
		// completes normally. It returns how many copies it deleted and how
		// many the statement's snapshot saw: fewer deleted means some
		// group's delivery had begun (a lease, or a held claim the delete
		// waited for and that acked the row). The dedup index is led by
		// (topic, consumer_group), so the groups holding keyed rows of the
		// topic are found first, one index probe each (a loose index scan),
		// and each group's row is then looked up by its full key: filtering
		// the key over the topic's whole range would read every keyed row.
		// The copies are deleted by id: a copy a MoveGroup had locked, in a
		// transaction of its own, is found again in its new group once that
		// commits; matched on its group it was left there, counted as being
		// delivered, and delivered later although it was cancelled.
		Cancel: fmt.Sprintf(`
WITH RECURSIVE grp(g) AS (
    (SELECT consumer_group FROM %[1]s WHERE topic = $1 AND dedup_key IS NOT NULL
      ORDER BY consumer_group LIMIT 1)
    UNION ALL
    SELECT (SELECT consumer_group FROM %[1]s WHERE topic = $1 AND dedup_key IS NOT NULL AND consumer_group > grp.g
             ORDER BY consumer_group LIMIT 1)
      FROM grp WHERE grp.g IS NOT NULL
), copies AS (
    SELECT id FROM %[1]s
     WHERE topic = $1 AND consumer_group IN (SELECT g FROM grp WHERE g IS NOT NULL) AND dedup_key = $2
), deleted AS (
    DELETE FROM %[1]s
     WHERE id = ANY (ARRAY(SELECT id FROM copies)) AND topic = $1 AND dedup_key = $2 AND lease_token IS NULL
    RETURNING 1
)
SELECT (SELECT count(*) FROM deleted), (SELECT count(*) FROM copies)`, t),
	}
}

func renameDLQ(n Names) string {
	if n.QDLQ == "" {
		return ""
	}
	return fmt.Sprintf(`UPDATE %s SET consumer_group = $3 WHERE topic = $1 AND consumer_group = $2`, n.QDLQ)
}

package query

import "fmt"

// DeleteDeadLetters deletes the dead letters with ids $1: a lookup of the
// primary key each.
func DeleteDeadLetters(n Names) string {
	return fmt.Sprintf(`DELETE FROM %s WHERE id = ANY ($1::bigint[])`, n.QDLQ)
}

-- Every paused group resumes: the claims of this version read the table,
-- so subscribers of this version must be gone first.
DROP TABLE IF EXISTS {{table "_paused"}};

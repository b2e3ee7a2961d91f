/*
 * The site's search order: the task guides first for the words they are about (a guide and
 * its sections), then the rest; the pages that mention everything (the benchmarks, the
 * architecture, the errors table) no longer come before the guide a reader looks for.
 * Sphinx's own weights otherwise (html_search_scorer in conf.py).
 */
var Scorer = {
  score: (result) => {
    const [docname, , , , score] = result;
    if (docname.startsWith("guides/") && docname !== "guides/index") return score + 20;
    if (docname === "getting-started") return score + 10;
    return score;
  },
  objNameMatch: 11,
  objPartialMatch: 6,
  objPrio: { 0: 15, 1: 5, 2: -5 },
  objPrioDefault: 0,
  title: 15,
  partialTitle: 7,
  term: 5,
  partialTerm: 2,
};

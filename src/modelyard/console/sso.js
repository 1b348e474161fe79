// The end of a single sign-on: the callback page carries the console session's token in a meta
// tag (never in a URL or a cookie); keep it where the console keeps keys, and open the console.
import { session } from "./api.js";

const meta = document.querySelector('meta[name="modelyard-session"]');
if (meta && meta.content) session.set(meta.content);
location.replace("/");
